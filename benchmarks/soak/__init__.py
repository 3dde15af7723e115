"""Long runs: load with engine faults, a unique-prompt flood against the memory bounds."""
