"""The ops: one handler per request op (handlers.py), and the replies they assemble:
stats, doctor, the KV ops' profiles and memory."""
