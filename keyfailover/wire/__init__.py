"""The wire: keyfailover's native protocol (frames, their codec and limits) and the message properties it carries.

Imports the core and nothing further out; the broker and the clients both build on it, and
neither imports the other.
"""
