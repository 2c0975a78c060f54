"""jaxpar: every classic form of parallelism, composable on one named-axis mesh."""
