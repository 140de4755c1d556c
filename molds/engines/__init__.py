"""Engines: how a model is driven across ranks. One file each; chosen here, explicitly."""


def build_engine(recipe, model, dist):
    name = recipe.parallel.engine
    if name == "ddp":
        from .ddp import DDPEngine

        return DDPEngine(recipe, model, dist)
    if name == "zero":
        from .zero import ZeroEngine

        return ZeroEngine(recipe, model, dist)
    raise ValueError(f"parallel.engine={name!r} is not built yet")
