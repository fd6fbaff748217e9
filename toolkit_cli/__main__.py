from toolkit_cli.app import main

main()
