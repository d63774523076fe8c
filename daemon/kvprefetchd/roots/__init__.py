"""The allowed roots: opened once, kept true by the scout, every open confined beneath
them, and each judged by its file system's tier profile and residency rule."""
