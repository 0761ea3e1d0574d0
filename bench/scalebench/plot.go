package scalebench

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"io"
	"math"
	"slices"
	"strings"
)

// Plot draws the points as a PNG: scheduler throughput, the control plane
// process's resident memory and the controller's, each against the node
// count, one curve per mix. Drawn with the standard library only (lines, a
// 5x7 bitmap font): devcluster carries no plotting module.
func Plot(w io.Writer, points []Point) error {
	const panelW, panelH, scale = 420, 380, 2
	panels := []struct {
		title string
		value func(Point) float64
	}{
		{"PODS BOUND/S (ALL BUT GANGS)", func(p Point) float64 { return p.General().PodsPerSec }},
		{"CONTROL PLANE RSS MIB", func(p Point) float64 { return mib(p.CPRSS) }},
		{"GPUDRA-CONTROLLER RSS MIB", func(p Point) float64 { return mib(p.CtrlRSS) }},
	}
	img := image.NewRGBA(image.Rect(0, 0, panelW*len(panels), panelH+40))
	fill(img, img.Bounds(), color.White)
	var mixes []string
	maxNodes := 0
	for _, p := range points {
		if !slices.Contains(mixes, p.Mix) {
			mixes = append(mixes, p.Mix)
		}
		maxNodes = max(maxNodes, p.Nodes)
	}
	for i, m := range mixes {
		x := 10 + i*260
		fill(img, image.Rect(x, panelH+16, x+24, panelH+22), palette[i%len(palette)])
		text(img, x+30, panelH+12, strings.ToUpper(m), color.Black, scale)
	}
	for pi, panel := range panels {
		x0, y0 := pi*panelW+70, 40
		x1, y1 := pi*panelW+panelW-20, panelH-40
		maxV := 0.0
		for _, p := range points {
			maxV = math.Max(maxV, panel.value(p))
		}
		step := niceStep(maxV / 4)
		top := step * math.Ceil(maxV/step)
		if top == 0 {
			top = 1
		}
		text(img, pi*panelW+10, 10, panel.title, color.Black, scale)
		px := func(n int) int { return x0 + int(float64(x1-x0)*float64(n)/float64(max(maxNodes, 1))) }
		py := func(v float64) int { return y1 - int(float64(y1-y0)*v/top) }
		// Axes and ticks.
		line(img, x0, y1, x1, y1, color.Black)
		line(img, x0, y0, x0, y1, color.Black)
		for v := 0.0; v <= top+step/2; v += step {
			y := py(v)
			line(img, x0-4, y, x0, y, color.Black)
			line(img, x0+1, y, x1, y, color.Gray{Y: 225})
			label := trimFloat(v)
			text(img, x0-8-len(label)*6*scale, y-7, label, color.Black, scale)
		}
		var ticks []int
		for _, p := range points {
			if !slices.Contains(ticks, p.Nodes) {
				ticks = append(ticks, p.Nodes)
			}
		}
		for _, n := range append([]int{0}, ticks...) {
			x := px(n)
			line(img, x, y1, x, y1+4, color.Black)
			label := fmt.Sprint(n)
			text(img, x-len(label)*3*scale, y1+8, label, color.Black, scale)
		}
		text(img, (x0+x1)/2-15*scale, y1+26, "NODES", color.Black, scale)
		for mi, m := range mixes {
			c := palette[mi%len(palette)]
			var pts [][2]int
			for _, p := range points {
				if p.Mix == m {
					pts = append(pts, [2]int{px(p.Nodes), py(panel.value(p))})
				}
			}
			slices.SortFunc(pts, func(a, b [2]int) int { return a[0] - b[0] })
			for i, pt := range pts {
				fill(img, image.Rect(pt[0]-3, pt[1]-3, pt[0]+4, pt[1]+4), c)
				if i > 0 {
					thickLine(img, pts[i-1][0], pts[i-1][1], pt[0], pt[1], c)
				}
			}
		}
	}
	return png.Encode(w, img)
}

var palette = []color.RGBA{{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x94, 0x67, 0xbd, 0xff}}

// niceStep rounds a tick step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return s
}

func fill(img *image.RGBA, r image.Rectangle, c color.Color) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.Set(x, y, c)
		}
	}
}

// line draws a one-pixel line (Bresenham).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := 1, 1
	if x0 > x1 {
		sx = -1
	}
	if y0 > y1 {
		sy = -1
	}
	e := dx + dy
	for {
		img.Set(x0, y0, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		if e2 := 2 * e; e2 >= dy {
			e += dy
			x0 += sx
		} else {
			e += dx
			y0 += sy
		}
	}
}

func thickLine(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	for _, o := range [][2]int{{0, 0}, {1, 0}, {0, 1}, {1, 1}} {
		line(img, x0+o[0], y0+o[1], x1+o[0], y1+o[1], c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// text draws s (upper case, digits and a little punctuation) at x, y, each
// pixel of the 5x7 glyphs scale x scale.
func text(img *image.RGBA, x, y int, s string, c color.Color, scale int) {
	for _, r := range strings.ToUpper(s) {
		g, ok := glyphs[r]
		if !ok {
			g = glyphs['?']
		}
		for row, bits := range g {
			for col, b := range bits {
				if b == '#' {
					fill(img, image.Rect(x+col*scale, y+row*scale, x+(col+1)*scale, y+(row+1)*scale), c)
				}
			}
		}
		x += 6 * scale
	}
}

var glyphs = map[rune][7]string{
	'A': {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},
	'B': {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."},
	'C': {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."},
	'D': {"####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."},
	'E': {"#####", "#....", "#....", "####.", "#....", "#....", "#####"},
	'F': {"#####", "#....", "#....", "####.", "#....", "#....", "#...."},
	'G': {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"},
	'H': {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},
	'I': {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."},
	'J': {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."},
	'K': {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"},
	'L': {"#....", "#....", "#....", "#....", "#....", "#....", "#####"},
	'M': {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"},
	'N': {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"},
	'O': {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},
	'P': {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."},
	'Q': {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"},
	'R': {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"},
	'S': {".####", "#....", "#....", ".###.", "....#", "....#", "####."},
	'T': {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."},
	'U': {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},
	'V': {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."},
	'W': {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."},
	'X': {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"},
	'Y': {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."},
	'Z': {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"},
	'0': {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."},
	'1': {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."},
	'2': {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"},
	'3': {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."},
	'4': {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."},
	'5': {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."},
	'6': {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."},
	'7': {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."},
	'8': {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."},
	'9': {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."},
	'.': {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."},
	'-': {".....", ".....", ".....", "#####", ".....", ".....", "....."},
	'/': {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."},
	'(': {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."},
	')': {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."},
	'%': {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"},
	':': {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."},
	',': {".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."},
	'=': {".....", ".....", "#####", ".....", "#####", ".....", "....."},
	'?': {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."},
	' ': {".....", ".....", ".....", ".....", ".....", ".....", "....."},
}
