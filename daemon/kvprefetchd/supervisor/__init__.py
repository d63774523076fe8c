"""The supervisor: one thread, one event loop (loop.py).

Admission (admit.py) splits a request's files across the workers, the books (books.py)
give every accepted file exactly one outcome, and the pool (pool.py) spawns, feeds and
reaps the worker processes: each one's end of the channel (handle.py), what it is told
before the fork (plans.py), and how they are stopped by a deadline (halting.py). The
listeners hand it frames; the ops answer them.
"""
