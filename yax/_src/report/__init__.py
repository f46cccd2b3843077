"""What a tree holds and costs (the summary table, FLOP rules) and the
interactive viewers (HTML page, Google Model Explorer). The viewer's
page, style and script are package data in ``viewer/``.
"""
