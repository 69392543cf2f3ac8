"""``python -m fp8lab ...`` (and ``torchrun -m fp8lab compare ...``): the ``fp8lab`` command line."""

from fp8lab.cli import main

if __name__ == "__main__":
    main()
