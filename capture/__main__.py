from capture._cli import run

run()
