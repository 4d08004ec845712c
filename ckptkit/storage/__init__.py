"""Where bytes live: local files (atomic commits, the kernel copy, small files read with
bounds) and objects at URLs (ranged reads through a back-end, uploads committed in order).
Nothing above this room asks whether a path is a URL; everything here imports only
``ckptkit.errors`` and its own modules."""
