"""One plain function per event type: `handle_<type>(job, event, entry_id, now) -> Outcome`.

A handler takes the job's state, one typed event (chameleond.events, validated by the protocol), its
stream entry id and the time it was read, changes the state, and says what happened
(`chameleond.handlers.outcome.Outcome`). Handlers are idempotent: a redelivered entry changes
nothing the first delivery did not. The daemon owns the table that maps each event type to its
handler (chameleond/daemon/dispatch.py); nothing here imports the daemon."""
