"""Layout search (``wb.search``, ``wb.SearchResult``): a layer above ``planning``.

A private package: ``space`` (what is enumerated: the hardware, its mesh splits, the
candidates) -> ``result`` (``SearchResult``: rows, best plan, Pareto front) -> ``search``
(``search``, ``SearchOptions``: each candidate planned by formula, ranked by predicted step
time, the best few compiled). It imports ``planning``; nothing in ``planning`` imports it.
Importing it imports none of its modules.
"""
