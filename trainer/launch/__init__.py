"""`keel train` around the workers: flags and validation, the torchrun agent with its fork server, the restart
budget, and processes that end with their parent. The launcher never imports torch before it starts the agent;
only the forked worker imports the train loop."""
