"""`python -m rlhf_cli <command> ...` (what torchrun and the deepspeed launcher run)."""

from rlhf_cli.cli import main

if __name__ == "__main__":
    main()
