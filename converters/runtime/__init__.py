"""What both conversion paths run on: worker tasks (``tasks``: threads or processes, stopping and
error reporting) and the atomic destination (``staging``: a locked temp dir renamed into place).
Nothing here imports another converter module."""
