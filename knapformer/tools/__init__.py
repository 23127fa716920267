"""Tools built on the library (demo, plots, simulator); nothing in the library imports them."""

__all__: list[str] = []
