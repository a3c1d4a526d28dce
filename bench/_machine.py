"""What machine a benchmark ran on (written next to every result): see tqvec/_machine.py."""

from tqvec._machine import machine_info

__all__ = ["machine_info"]
