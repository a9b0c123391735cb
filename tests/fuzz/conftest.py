"""``fuzz``-marked tests (the long run) are deselected unless the ``-m`` expression names ``fuzz``."""


def pytest_collection_modifyitems(config, items):
    if "fuzz" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("fuzz") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("fuzz") is not None])
        items[:] = kept
