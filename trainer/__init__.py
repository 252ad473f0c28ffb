"""The embedded trainer: model, data, parallel layout, train loop. May import keel.monitor and keel.chaos."""
