"""`python -m servegate.simulator --port 8000 ...` (the same options as `servegate sim`)."""

from servegate.simulator.cli import main

if __name__ == "__main__":
    main()
