"""k2-launcher: schedules."""
