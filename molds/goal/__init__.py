"""Goal-directed fine-tuning: REINVENT-style reinforcement learning of a molds decoder
toward a scoring function (``molds.scoring``), run by ``molds/train.py`` when the recipe
names ``goal.prior`` (the recipe's ``goal`` section: ``molds.recipe.goal``). ``ledger``: the
calls, cache, diversity filter and memory every rank shares; ``plan``: the scorers and
stages of a goal recipe; ``loop``: the run.

May import the packages below it in molds' stack: ``errors``, ``runtime``, ``chemistry``,
``recipe``, ``data``, ``models``, ``kernels``, ``checkpoint``, ``engines``, ``scoring``,
``metrics``, ``eval``.
"""
