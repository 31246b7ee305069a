"""Pictures for the chapters: matplotlib figures built from minserve's real components.

Each helper returns a `matplotlib.figure.Figure` made without pyplot, so nothing depends
on an interactive backend: a notebook displays the returned figure, a script saves it.
"""
