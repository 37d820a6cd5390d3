"""mgrpo's own costs, measured (see benchmarks/__init__.py for the map)."""
