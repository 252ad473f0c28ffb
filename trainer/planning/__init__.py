"""Planning a job before it runs: GPU peaks, `keel estimate`'s cost, the memory model, `keel plan`'s layout
search, simulated scale, and the plan kept beside a run. The planner, estimate, memory model and GPU table
import no torch: they answer on a laptop."""
