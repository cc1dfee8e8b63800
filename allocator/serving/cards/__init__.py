"""Cards: what a device is to the simulator (presets.py: models and accelerators as numbers; the
shipped card files *.toml and the probe files *.probe.json beside this file), engine profiles
(profiles.py, ../engine_profiles/), the small data files a user hands in (datafile.py), and
`odma-hw calibrate` (cli.py), which measures a torch device for a card: measure.py (memory,
matrix products, effort), engine_steps.py (the engine's own reads and steps), fit.py (the
overheads' fit), write.py (the card and probe files written).
"""
