"""A library with process-wide state, as Accelerate's ``AcceleratorState`` is: the first call
in a process decides, and a later call that asks for something else is refused with "restart
your runtime". Imported by name (``tests.programs.stateful_library``), as a library is."""

_state: dict = {}


def configure(mixed_precision: str) -> str:
    """Set this process's precision once; a different one later raises, as Accelerate does."""
    if _state and _state["mixed_precision"] != mixed_precision:
        raise ValueError(
            "State has already been initialized and cannot be changed, restart your runtime "
            f"completely and pass `mixed_precision={mixed_precision!r}`.")
    _state["mixed_precision"] = mixed_precision
    return mixed_precision
