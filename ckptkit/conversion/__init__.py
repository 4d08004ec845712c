"""The conversion behind ``ckptkit.convert``, one job a module.

- ``options.py``: how the source is read and what the output is (``ReadOptions``,
  ``OutputOptions``).
- ``plan.py``: what will be written, from headers alone (keys, dtypes, shards, ties).
- ``write.py``: the plan written through a ``storage.destination.Destination``, one loop.
- ``report.py``: ``ConvertReport``, and the metadata written into the output's header.
- ``run.py``: one model's conversion, from the source to its destination.

``ckptkit.convert`` is the public front (its keyword API, and a diffusers pipeline sent to
``pipeline_convert.py``).
"""
