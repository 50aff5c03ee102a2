"""Operations on a store: saves and loads, regions, statistics, locks, gc, the commit order,
accelerator paths."""
