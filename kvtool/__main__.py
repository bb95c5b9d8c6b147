"""`python -m kvtool` runs the command line."""

from kvtool.cli import main

if __name__ == "__main__":
    main()
