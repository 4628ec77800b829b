enabled = True
