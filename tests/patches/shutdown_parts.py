"""What the shutdown patches' tests share (the fixture is conftest.py's `shutdown_upstream`)."""


def installed(parts, module) -> bool:
    """Whether `module`'s wrappers are installed (all of them, or none) on `parts`."""
    mark = f"_deepinfer_{module.__name__.rpartition('.')[2]}"
    marks = set()
    for cls, name in parts[module]:
        method, found = getattr(cls, name), False
        while method is not None and not found:
            found = getattr(method, mark, False)
            method = getattr(method, "__wrapped__", None)
        marks.add(found)
    assert len(marks) == 1, f"{module.__name__} is half installed"
    return marks.pop()
