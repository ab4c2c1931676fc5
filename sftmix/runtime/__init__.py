"""How a run lives and ends on this machine: settings from the environment, atomic files and what we own, stops and signals, child processes, CPUs, the console, secrets kept out of logs."""
