"""Where expert bytes live and how they move: budgets, slot tables, disk reads, transfers, the store."""
