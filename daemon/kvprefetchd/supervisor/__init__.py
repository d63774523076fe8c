"""The supervisor: one thread, one event loop (loop.py).

Admission (admit.py) splits a request's files across the workers, the books (books.py)
give every accepted file exactly one outcome, and the pool (pool.py) spawns, feeds and
reaps the worker processes. The listeners hand it frames; the ops answer them.
"""
