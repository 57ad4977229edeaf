"""The command line: `coordinator` (main.py), `coordinator doctor` (doctor.py) and
`coordinator quickstart` (quickstart.py). `python -m coordinator.cli` runs the same command."""
