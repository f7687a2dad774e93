import typer
app = typer.Typer()
@app.command()
def version():
    print("x")
