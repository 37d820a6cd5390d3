"""Entry points: mgrpo-train, mgrpo-convert, mgrpo-prepare, mgrpo-reward, mgrpo-plan."""
