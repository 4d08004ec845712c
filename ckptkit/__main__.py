"""``python -m ckptkit``."""

from ckptkit.cli import main

if __name__ == "__main__":
    main()
