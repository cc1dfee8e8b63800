"""Measuring a torch device for a card file (`odma-hw calibrate`, allocator/serving/calibrate.py):
measure.py (memory, matrix products, effort), engine_steps.py (the engine's own reads and
steps), fit.py (the overheads' fit), cardfile.py (the card and probe files written).
"""
