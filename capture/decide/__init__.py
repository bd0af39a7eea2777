"""`capture decide`: which card, how many, for how long, from every run in a results folder.

- ``runs``: open every manifest through the one door; the run definition of each trial
- ``rank``: groups by run definition, tested configurations, prices, cost and time to a target, ranking
- ``text``: the terminal table and ``--json``; ``site``: the static site; ``init``: a new results repository
"""
