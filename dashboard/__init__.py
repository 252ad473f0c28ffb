"""Streamlit dashboard: reads the run store through keel.monitor, never imports the trainer."""
