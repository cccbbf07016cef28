"""V-shape schedules of the paper: V-ZB, V-Half, V-Min."""
