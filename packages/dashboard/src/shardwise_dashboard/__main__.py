"""`python -m shardwise_dashboard ...` is `shardwise-dashboard ...`."""

from shardwise_dashboard.cli import main

if __name__ == "__main__":
    main()
