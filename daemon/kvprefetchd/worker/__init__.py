"""A worker process: receive files, skip what is warm or already on its way, warm the
rest through an engine, and report every file's outcome to the supervisor."""
