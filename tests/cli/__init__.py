"""The command line: bad input, convert and parity."""
