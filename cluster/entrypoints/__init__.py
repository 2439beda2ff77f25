"""Entry points: the ``pagedserve`` command line, ``serve`` and ``demo``; where the rooms are put together."""
