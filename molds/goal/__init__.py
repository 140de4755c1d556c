"""Goal-directed fine-tuning: REINVENT-style reinforcement learning of a molds decoder
toward a scoring function (``molds.scoring``), run by ``molds/train.py`` when the recipe
names ``goal.prior``. ``ledger``: the calls, cache, diversity filter and memory every rank
shares; ``loop``: the run."""
