"""Acting with world models: planners over imagined trajectories and closed-loop evaluation in the real env."""
