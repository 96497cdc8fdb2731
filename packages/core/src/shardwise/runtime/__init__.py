"""What runs during a forward and backward pass of a `ZeroModel` (engine/model.py): the
gather schedule and its units, gradient reduction, deferred parameter gathers, and the checks
that every rank runs the same pass."""
