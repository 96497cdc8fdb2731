"""One router per resource: ingestion, runs, the live stream, the page."""
