"""Saves of one checkpoint by many processes (``jax.distributed``): the job's runtime, its barriers
and their timeouts, the primary's merge of parts and the gathering of statistics up a tree; and
the votes of restores that share replicated bytes between the processes (``restore_vote``)."""
