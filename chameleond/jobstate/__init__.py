"""A job's state as the daemon keeps it: plain data and the transitions that change it, no I/O.

Below both the daemon (which persists and publishes it) and the handlers (which apply events to
it): neither imports the other through here.
"""
