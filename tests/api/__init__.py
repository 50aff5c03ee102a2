"""What users call: the manager, tiers, derive, diff, verify, watch, timelines, interop."""
